package main

import (
	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/ociimage"
)

// registryFlags are how a command reaches a registry. Credentials are never
// flags: they come from a Docker config directory.
type registryFlags struct {
	configDir string
	caFile    string
	insecure  []string
}

func (f *registryFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.configDir, "registry-config", "",
		"Docker config directory `DIR` with the registry credentials: DIR/config.json (\"auths\"), or DIR/.dockerconfigjson "+
			"as a Kubernetes dockerconfigjson secret is mounted (default $DOCKER_CONFIG, else ~/.docker; credential helpers are not run)")
	c.Flags().StringVar(&f.caFile, "ca-file", "",
		"`PATH` of a PEM file of CA certificates to trust for registry TLS, besides the system's (for a registry with a private CA)")
	c.Flags().StringArrayVar(&f.insecure, "insecure-registry", nil,
		"`HOST[:PORT]` of a registry that may be reached over plain HTTP (repeatable); every other registry needs verified TLS")
}

// options returns the flags as ociimage options. Layout references ignore
// them.
func (f *registryFlags) options() []ociimage.Option {
	opts := []ociimage.Option{ociimage.WithUserAgent("vmsnap/" + version)}
	if f.configDir != "" {
		opts = append(opts, ociimage.WithRegistryConfig(f.configDir))
	}
	if f.caFile != "" {
		opts = append(opts, ociimage.WithCAFile(f.caFile))
	}
	for _, h := range f.insecure {
		opts = append(opts, ociimage.WithInsecureRegistry(h))
	}
	return opts
}
