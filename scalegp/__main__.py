from scalegp.cli.app import main

main()
