"""Click commands owned by feature modules; `pipeline.cli` registers them."""
