"""What every modality's data shares: walking folders and archives safely, sniffing files, caching decoded tensors."""
