"""lowmem's version: recorded in every checkpoint and export (a module of its own, so that
they need not import the package's face, lowmem/__init__.py, which imports everything)."""
__version__ = "0.1.0"
