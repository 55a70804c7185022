"""A rank's process and its process groups: the generation of the groups (`generation`: broken
after a failed step, refused until renewed), stores on loopback addresses for runs on one
machine (`loopback`), the torch names that differ between releases (`compat`: the GPU
machines' 2.11 / 2.12 and this 2.13), and a process that ends with its parent (`lifetime`:
`hybridpar run`'s and `hybridpar tokenize`'s workers). A leaf: imports nothing of hybridpar."""
