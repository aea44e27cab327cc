from disttrain.cli import main

main()
