"""The probe maps (`probes/*.toml`): loading them (`loader`), release numbers (`versions`) and the
release matrix (`releases`). Data only: imports nothing else of the probe."""
