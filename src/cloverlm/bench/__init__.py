"""`clover bench`: Clover against its autoregressive peers in one process, one module per report section
(run.py documents the JSON), plus the report's plots."""
