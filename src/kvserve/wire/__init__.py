"""What kvserve's workers and its gateway say to each other over HTTP, defined once for both
sides (`http.py`). Imports nothing of kvserve (an import-linter contract), like `kvevents`."""
