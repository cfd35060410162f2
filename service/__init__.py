"""HTTP front end of ckptconv. Never imports torch, h5py or tensorflow."""
