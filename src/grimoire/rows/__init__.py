"""Rows: raw examples become token columns, one module per data format; bad rows reported together."""
