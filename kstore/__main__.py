from kstore.cli import main

main()
