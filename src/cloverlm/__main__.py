"""`python -m cloverlm ARGS` is `clover ARGS`; under torchrun, `torchrun ... -m cloverlm train ...` is a
data-parallel `clover train` (training/distributed.py)."""

from cloverlm.cli import main

if __name__ == "__main__":
    main()
