"""Every benchmark refuses a bad flag in one line (exit 2) before it writes, builds or launches anything. (The
benchmarks of the cost of scale have their refusals beside their runs: test_scaling_bench.py, test_comm_bench.py,
test_predict_bench.py, test_memory_bench.py, test_overhead.py, test_gpu_bench.py.)"""

import pytest

from disttrain.cli.main import main


@pytest.mark.parametrize("args, says", [
    (["startup", "--strategies", "ddp,"], "--strategies 'ddp,': name strategies separated by commas"),
    (["startup", "--strategies", "deepspeed:9"], "--strategies 'deepspeed:9': 'deepspeed:9' is not a strategy"),
    (["startup", "--strategies", "ddp+pp0"], "--strategies 'ddp+pp0': a layout is +ppN or +tpN"),
    (["startup", "--nproc", "0"], "--nproc 0: must be >= 1"),
    (["wire", "--mib", "0"], "--mib 0: must be >= 1"),
    (["weight-sync", "--bucket-mb", "nan"], "--bucket-mb nan: must be >= 0.001"),
    (["weight-sync", "--d-model", "129"], "--d-model 129: must divide into heads"),
    (["service", "--steps", "5", "--warmup", "5"], "--warmup 5: must be below --steps 5"),
    (["data", "--threads", "0"], "--threads 0: must be >= 1"),
    (["data", "--slow-model", "model.n_head=3"], "--slow-model model.n_head=3: model.d_model = 128 is not divisible"),
    (["checkpoint", "--rounds", "0"], "--rounds 0: must be >= 1"),
    (["checkpoint", "--d-model", "12"], "--d-model 12: must be a multiple of 8"),
    (["loss-parallel", "--nproc", "0"], "--nproc 0: must be >= 1"),
    (["loss-parallel", "--steps", "0"], "--steps 0: must be >= 1"),
    (["loss-parallel", "--vocabs", "256,1e3"], "--vocabs '256,1e3': give sizes >= 256 divisible by --nproc 2"),
    (["loss-parallel", "--vocabs", "128,256"], "--vocabs '128,256': give sizes >= 256"),
    (["pipeline", "--microbatches", ","], "--microbatches ',': give counts >= the 2 stages separated by commas, e.g. "
                                          "--microbatches 2,4,8"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, args, says):
    name, *flags = args
    assert main(["bench", name, *flags, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: " + says) and "\n" not in err, err
    assert not (tmp_path / "b").exists()


def test_integer_lists_are_distinct_sorted_and_bounded():
    from disttrain.bench import integers
    from disttrain.errors import ConfigError

    assert integers(" 8, 2,8,,4 ", "--gpus", "counts >= 1", "8,64") == [2, 4, 8]
    assert integers("3", "--n", "x", "3", low=3, high=3) == [3]
    for text in ("", "2,x", "0,2", "2,9"):
        with pytest.raises(ConfigError, match=f"^--gpus '{text}': give counts 1..8 separated by commas, e.g. --gpus 1"):
            integers(text, "--gpus", "counts 1..8", "1", high=8)


def test_a_number_out_of_its_range_names_the_range_or_what_to_give():
    from disttrain.bench import check_numbers
    from disttrain.errors import ConfigError

    check_numbers(("--a", 4, 1, None, 4), ("--b", 0.5, 0, "a fraction", 1))
    for flag, says in (("--a", "--a 5: must be in 1..4"), ("--b", "--b 1.5: give a fraction")):
        with pytest.raises(ConfigError, match=f"^{says}$"):
            check_numbers(("--a", 5 if flag == "--a" else 4, 1, None, 4), ("--b", 1.5 if flag == "--b" else 1, 0,
                                                                           "a fraction", 1))
