"""An example plugin package with one composer_lightning head."""
