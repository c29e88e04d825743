"""`python -m longpatch ...` (and `accelerate launch -m longpatch ...`) run the CLI."""
from .cli import main

main()
