"""What talks to the object store: the S3 client, its HTTP stacks, signing, credentials and errors."""
