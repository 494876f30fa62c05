"""A second shipped pipeline of another shape: order lines and sales per (sku, store)."""
