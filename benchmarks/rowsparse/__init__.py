"""`jaxembed bench sparse`: row-sparse optimizer steps against dense ones (`bench`)."""
