"""``python -m experiments NAME [options]``: run one of the papers' experiments."""

from experiments import main

main()
