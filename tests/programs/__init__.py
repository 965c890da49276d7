"""Users' own training programs, written only against the public API."""
