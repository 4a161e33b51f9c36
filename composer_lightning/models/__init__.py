"""Model helpers: loading, and tiny models built offline."""
