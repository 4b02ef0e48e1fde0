"""The course as a static website (given): `python main.py site` builds it into results/site/ (build.py).
Importing this package imports nothing heavy; Sphinx is loaded only to build."""
