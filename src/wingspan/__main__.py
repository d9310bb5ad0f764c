from wingspan.cli import main

# Guarded: a spawned child process imports the main module again (as __mp_main__) and must not rerun the command.
if __name__ == "__main__":
    main()
