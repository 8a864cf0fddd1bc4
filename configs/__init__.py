"""Shipped recipes (YAML run files), installed as `compiletune.configs`; see compiletune/recipes.py."""
