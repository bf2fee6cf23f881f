package ociimage

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Registry credentials come from a Docker config directory only: never from
// argv or the environment (bar DOCKER_CONFIG naming the directory), and they
// never appear in an error message or a log. Messages name the file they came
// from instead.

// Names of the credentials file in a Docker config directory: Docker's own,
// and the key of a Kubernetes dockerconfigjson secret, which is the file's
// name when the secret is mounted as a volume.
const (
	dockerConfigFile = "config.json"
	k8sConfigFile    = ".dockerconfigjson"
	maxConfigFile    = 4 << 20
)

// credentials is what vmsnap found for one registry host.
type credentials struct {
	auth authn.Authenticator
	// where tells people where credentials were looked for or found, for
	// error messages: never the credentials themselves.
	where string
	found bool
}

// dockerConfig is the part of a Docker config file vmsnap reads.
type dockerConfig struct {
	Auths map[string]struct {
		Auth          string `json:"auth"`
		Username      string `json:"username"`
		Password      string `json:"password"`
		IdentityToken string `json:"identitytoken"`
		RegistryToken string `json:"registrytoken"`
	} `json:"auths"`
	CredsStore  string            `json:"credsStore"`
	CredHelpers map[string]string `json:"credHelpers"`
}

// loadCredentials finds the credentials for host in the Docker config
// directory dir (or, if dir is "", in $DOCKER_CONFIG, else ~/.docker). A
// directory named explicitly must hold config.json or .dockerconfigjson; the
// default one may be missing (anonymous access).
func loadCredentials(dir, host string) (credentials, error) {
	explicit := dir != ""
	if !explicit {
		dir = os.Getenv("DOCKER_CONFIG")
	}
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return credentials{auth: authn.Anonymous, where: "no Docker config directory (HOME is not set; use --registry-config DIR)"}, nil
		}
		dir = filepath.Join(home, ".docker")
	}
	var (
		path string
		data []byte
	)
	for _, name := range []string{dockerConfigFile, k8sConfigFile} {
		p := filepath.Join(dir, name)
		b, err := readLimited(p, maxConfigFile)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return credentials{}, errcode.Wrap(errcode.InvalidInput, err, "cannot read the registry credentials file %s", p)
		}
		path, data = p, b
		break
	}
	if path == "" {
		if explicit {
			return credentials{}, errcode.New(errcode.InvalidInput,
				"the registry config directory %s holds neither %s nor %s; give the directory of a Docker config or of a mounted dockerconfigjson secret",
				dir, dockerConfigFile, k8sConfigFile)
		}
		return credentials{auth: authn.Anonymous, where: "no " + filepath.Join(dir, dockerConfigFile)}, nil
	}

	var cfg dockerConfig
	if err := json.NewDecoder(bytes.NewReader(data)).Decode(&cfg); err != nil {
		// Not the decoder's text: it can quote the file's content.
		var where string
		var se *json.SyntaxError
		if errors.As(err, &se) {
			where = " near byte " + itoa(se.Offset)
		}
		return credentials{}, errcode.New(errcode.InvalidInput, "%s is not a valid Docker config file (invalid JSON%s)", path, where)
	}
	for key, e := range cfg.Auths {
		if configHost(key) != strings.ToLower(host) {
			continue
		}
		ac := authn.AuthConfig{Username: e.Username, Password: e.Password, IdentityToken: e.IdentityToken, RegistryToken: e.RegistryToken}
		if e.Auth != "" {
			raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(e.Auth))
			user, pass, ok := strings.Cut(string(raw), ":")
			if err != nil || !ok {
				return credentials{}, errcode.New(errcode.InvalidInput,
					"the \"auth\" entry for %s in %s is not base64 of USER:PASSWORD", key, path)
			}
			ac.Username, ac.Password = user, pass
		}
		if ac == (authn.AuthConfig{}) {
			continue
		}
		return credentials{auth: authn.FromConfig(ac), where: "the credentials for " + host + " in " + path, found: true}, nil
	}
	where := "no credentials for " + host + " in " + path
	if h := cfg.CredHelpers[host]; h != "" {
		where += " (it names credential helper docker-credential-" + h + ", which vmsnap does not run)"
	} else if cfg.CredsStore != "" {
		where += " (it names credential store docker-credential-" + cfg.CredsStore + ", which vmsnap does not run)"
	}
	return credentials{auth: authn.Anonymous, where: where}, nil
}

// configHost reduces a key of "auths" to HOST[:PORT]: Docker writes
// https://HOST/v1/ for some registries and HOST for others.
func configHost(key string) string {
	key = strings.TrimSpace(key)
	if i := strings.Index(key, "://"); i >= 0 {
		key = key[i+3:]
	}
	key, _, _ = strings.Cut(key, "/")
	return strings.ToLower(key)
}

func readLimited(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readAtMost(f, limit, func() error {
		return errors.New("file is larger than " + itoa(limit) + " bytes")
	})
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
