"""Alembic migration scripts (the schema of record), shipped inside the package."""
