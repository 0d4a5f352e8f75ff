"""Migration revisions; Alembic skips this file."""
