"""One module per DVC stage; each stage script and Prefect task calls these functions."""
