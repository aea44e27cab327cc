"""`disttrain completion bash|zsh`: a completion script for the shell, generated from the CLI's own parser.

    eval "$(disttrain completion bash)"      # in ~/.bashrc
    eval "$(disttrain completion zsh)"       # in ~/.zshrc (through zsh's bashcompinit)
"""

from __future__ import annotations

import argparse


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """A command's options and, for a command with subcommands or choices, those words."""
    words = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    words += list(_subcommands(parser))
    words += [c for a in parser._actions if not a.option_strings and a.choices
              and not isinstance(a, argparse._SubParsersAction) for c in a.choices]
    return sorted(dict.fromkeys(words))


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    commands = _subcommands(parser)
    cases = "\n".join(f'    {name}) words="{" ".join(_words(sub))}" ;;' for name, sub in commands.items())
    body = f'''_disttrain() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" words=""
  if (( COMP_CWORD == 1 )); then
    COMPREPLY=( $(compgen -W "{" ".join([*commands, "--version", "--help"])}" -- "$cur") )
    return
  fi
  case "${{COMP_WORDS[1]}}" in
{cases}
  esac
  COMPREPLY=( $(compgen -W "$words" -- "$cur") )
}}
complete -o default -F _disttrain disttrain
'''
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + body
    return body
