"""Pure logic, without a broker or PostgreSQL, by kstore package."""
