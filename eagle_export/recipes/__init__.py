"""The shipped build recipes (YAML). This folder installs as the package data `eagle_export.recipes`;
code reads it with importlib.resources, never by a path into the source tree."""
