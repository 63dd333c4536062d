"""`python -m jaxpipe.planner`: the planner's table (`cli.py`)."""

from jaxpipe.planner.cli import main

if __name__ == "__main__":
    main()
