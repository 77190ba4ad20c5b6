"""`jaxembed bench bags`: pooled lookups against XLA's take + sum (`bench`)."""
