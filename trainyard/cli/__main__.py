"""`python -m trainyard.cli`: the same program as the `trainyard` console script."""
from trainyard.cli import main

if __name__ == "__main__":  # importing the module (pkgutil.walk_packages does) runs nothing
    main()
