"""megagrpo's benchmarks: one script per benchmark (run alone as ``python benchmarks/<name>.py``)
and the suite that runs them all (``python -m benchmarks run``, ``suite.py``) and writes the README's
"Measured" table from their saved results (``python -m benchmarks readme``, ``readme_table.py``)."""
