"""kstore.db without a database: SQL text judged by tokens, the SQLAlchemy internals it reads."""
