from regen.cli import main

main()
