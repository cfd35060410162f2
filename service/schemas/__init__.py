"""Request and response schemas, one module per resource."""
