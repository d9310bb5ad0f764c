from wingspan.cli import main

main()
