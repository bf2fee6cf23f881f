package main

import "github.com/spf13/cobra"

// flagGroup is a set of flags that several commands take (registry,
// stream, encryption, signatures, the agent): each command lists the
// groups it takes, and each group registers its flags.
type flagGroup interface{ add(*cobra.Command) }

// addFlagGroups registers the flags of groups on c.
func addFlagGroups(c *cobra.Command, groups ...flagGroup) {
	for _, g := range groups {
		g.add(c)
	}
}
