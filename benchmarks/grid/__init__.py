"""The grid: jaxembed's default 1-device step against FBGEMM's TBE on the very same ids, over a
sample of batch sizes, dims, bag lengths, id laws and table sizes (`bench`)."""
