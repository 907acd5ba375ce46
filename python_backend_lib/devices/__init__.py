"""What any torch code needs to put work on a device, below the audio features and
the engine alike: which GPU a thread's work goes to (`placement`), small copies
between host and device that do not wait for the device (`transfers`), and the
batch-size buckets of captured CUDA graphs (`buckets`)."""
