"""megadlms.data (being written)."""
