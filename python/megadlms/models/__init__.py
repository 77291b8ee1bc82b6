"""megadlms.models (being written)."""
