"""The sample drafters and the scripts that made them. This folder installs as `eagle_export.samples`
(the drafters' config.json and model.safetensors as package data); code reads it with importlib.resources."""
