"""The cache tiers and their policy: the memory cache, the disk tier, block planning, buffers, pages and checksums."""
