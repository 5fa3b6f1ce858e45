# kernel-builder's flake for this collection. Each built repo in dist/<name>/ carries
# its own flake.nix of this form. Nix cannot reach its binary caches from the project's
# machines, so scripts/build.py (plain Python) is what builds the repos here.
{
  description = "Pallas TPU kernels for PyTorch (TorchTPU), published to the Kernels Hub";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
