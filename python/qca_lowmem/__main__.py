from .trainer.cli import entry

entry()
