"""The PostgreSQL lock backend, in its two modes over one table and one set of statements:

- ``session_mode``: a session advisory lock on a dedicated connection per sidecar; a crashed
  holder is replaced the instant its session ends (``PostgresBackend``; ``force_release``,
  the rule of ``kubectl singleton release`` for both modes);
- ``pooled_mode``: a row valid until an expiry from the database clock, in single short
  statements that work through a transaction-mode pooler (``PooledPostgresBackend``);
- ``connection``: what a backend's connection must be (a server session, its settings, the
  schema) and the helpers both modes share;
- ``sql``: every statement, and the rules for the names in them.
"""
