"""The data, on the host: datasets by name (datasets, cifar, files), transforms, the seeded
batch order (batches), image folders (images, decode)."""
