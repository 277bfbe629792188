"""Where lowmem looks for data files, and the one error for data it cannot find or read.

Directory lookup (first match wins): an explicit ``data_dir`` replaces the default list;
otherwise ``$LOWMEM_DATA`` then ``~/.cache/lowmem`` (`search_dirs`). Every failure to find,
fetch or read data is a `DataError` (a `ValueError`) whose message names the file and the problem.
"""
import os
from pathlib import Path

ALTERNATIVES = ("Alternatives that need no download: `--dataset fashion-mnist` "
                "(Debian package dataset-fashion-mnist) or `--dataset synthetic`.")


class DataError(ValueError):
    """Data files are missing, malformed, or cannot be fetched."""


def search_dirs(data_dir):
    """[(directory, why it is searched)] in lookup order."""
    if data_dir is not None:
        return [(Path(data_dir).expanduser(), "data_dir")]
    dirs = []
    if os.environ.get("LOWMEM_DATA"):
        dirs.append((Path(os.environ["LOWMEM_DATA"]).expanduser(), "$LOWMEM_DATA"))
    dirs.append((Path.home() / ".cache" / "lowmem", "default"))
    return dirs


def dir_list(dirs):
    return "\n".join(f"  {d}  ({why})" for d, why in dirs)
