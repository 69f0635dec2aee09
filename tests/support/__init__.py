"""What tests share: the fp64 model oracle, the pipeline harness, the helpers of the job tests. No tests."""
