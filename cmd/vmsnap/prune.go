package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
)

func newPruneCmd(out *globalOutput) *cobra.Command {
	var reg registryFlags
	var keep int
	var dryRun bool
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "prune REPO --keep N [--dry-run]",
		Short: "Keep a repository's N newest checkpoints and delete the older ones",
		Long: `Keep the N newest checkpoints stored in a repository and delete the older
ones, with their tags. REPO is oci:DIR or HOST[:PORT]/REPO, without tag or
digest: the rule applies to the whole repository, so give each VM a
repository of its own.

Which checkpoints: the VM state images the repository's tags name, and,
following each one's dev.vmsnap.previous annotation (the image its tag named
before that checkpoint moved it), those whose tag has moved on. Newest first
by their org.opencontainers.image.created annotation (a tie goes to the later
one in a chain); one without a valid time is always kept.

What goes with a deleted checkpoint: its state manifest and tags; its disk and
rootfs images (dev.vmsnap.disk.image, dev.vmsnap.rootfs.image) if they are in
REPO, no kept checkpoint and no tag names them, and they are the kind of image
the annotation says (others are left, and listed with the reason); the
referrers fallback tag (sha256-HEX) of whatever is deleted.

In an OCI layout, index.json is rewritten first (atomically), then the blobs
no remaining manifest needs are deleted. A registry deletes manifests by
digest (it must allow deletes: storage.delete.enabled in distribution's
config) and frees their blobs in its own garbage collection.

Never deleted: a kept checkpoint, the images it names, its subject, a blob a
kept image shares, the fallback tags of kept images, anything no checkpoint
links to. Deletion runs oldest first, so an interrupted prune leaves every
kept checkpoint restorable and can be run again.

--dry-run lists what would go and deletes nothing. Registry access works as
for checkpoint (--registry-config, --ca-file, --insecure-registry).

Exit status: 0 on success; 2 (USAGE) for bad flags or a REPO with a tag or
digest; 8 (AUTH_FAILED) when the registry refuses the credentials; 9
(REGISTRY_ERROR) for any other failure of the store, among them a registry
that does not allow deletes ("enable storage.delete in its config"); 11
(INVALID_INPUT) for a malformed manifest or tag list (see
docs/errors-and-guarantees.md).`,
		Example: `  vmsnap prune oci:/var/lib/snapshots --keep 3 --dry-run
  vmsnap prune registry.example:5000/vms/vm1 --keep 5 --json`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			if !c.Flags().Changed("keep") {
				return errcode.New(errcode.Usage, "prune needs --keep N, the number of newest checkpoints to keep")
			}
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			res, err := snapshot.Prune(ctx, snapshot.PruneSpec{Repo: args[0], Keep: keep, DryRun: dryRun, Store: reg.options()})
			if err != nil {
				return coded(err)
			}
			report(out, res, func(w io.Writer) { printPrune(w, res) })
			return nil
		},
	}
	c.Flags().IntVar(&keep, "keep", 0, "keep the `N` newest checkpoints, at least 1 (required)")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "list what would be deleted, and delete nothing")
	c.Flags().DurationVar(&timeout, "timeout", 30*time.Minute, "give up after this long")
	reg.add(c)
	addOutputFlags(c, out, false)
	return c
}

func printPrune(w io.Writer, r *api.PruneResult) {
	if r.Error != nil {
		fmt.Fprintf(w, "prune of %s failed: %s: %s\n", r.Repository, r.Error.Code, r.Error.Message)
		return
	}
	verb := "removed"
	if r.DryRun {
		verb = "would remove"
	}
	fmt.Fprintf(w, "%s: keeping %d of %d checkpoints (--keep %d)\n", r.Repository, len(r.Kept), len(r.Kept)+len(r.Removed), r.Keep)
	line := func(what string, cp api.PrunedCheckpoint) {
		when := "undated"
		if cp.Created != nil {
			when = cp.Created.Format(time.RFC3339)
		}
		tags := ""
		if len(cp.Tags) > 0 {
			tags = " (" + strings.Join(cp.Tags, ", ") + ")"
		}
		fmt.Fprintf(w, "  %-12s %s %s%s\n", what, when, cp.Digest, tags)
	}
	for _, cp := range r.Kept {
		line("kept", cp)
	}
	for _, cp := range r.Removed {
		line(verb, cp)
	}
	for _, im := range r.RemovedImages {
		fmt.Fprintf(w, "  %-12s image %s\n", verb, im.Image)
	}
	for _, im := range r.LeftImages {
		fmt.Fprintf(w, "  %-12s image %s: %s\n", "left", im.Image, im.Reason)
	}
	if r.RemovedBlobs > 0 {
		fmt.Fprintf(w, "  %d unreferenced blobs deleted\n", r.RemovedBlobs)
	}
}
