"""megagrpo's benchmarks: one module per benchmark (``python -m benchmarks.<name>``), each writing
its measurements in one record format (``common/record.py``); the suite that runs them
(``python -m benchmarks run``) and README.md's Measured table from their results
(``python -m benchmarks readme``)."""
