package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is the cluster's certificate authority and the keys made from it, as
// PEM files in dir.
type pki struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	CAFile string
}

func newPKI(dir string) (*pki, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "vmsnap test cluster CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(48 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, ca: ca, caKey: key, CAFile: filepath.Join(dir, "ca.crt")}
	if err := writePEM(p.CAFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	// The controller manager signs with it (CertificateSigningRequests).
	return p, writeKey(filepath.Join(dir, "ca.key"), key)
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// issue makes a key pair and a certificate for it signed by the CA: a
// client certificate for cn in the groups orgs, and a server certificate
// too when hosts is not empty. It returns the paths of both PEM files.
func (p *pki) issue(name, cn string, orgs []string, hosts ...string) (certFile, keyFile string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(48 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	if len(hosts) > 0 {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return "", "", err
	}
	certFile, keyFile = filepath.Join(p.dir, name+".crt"), filepath.Join(p.dir, name+".key")
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	return certFile, keyFile, writeKey(keyFile, key)
}

// serviceAccountKey makes the key pair that signs service account tokens.
func (p *pki) serviceAccountKey() (pubFile, keyFile string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	pubFile, keyFile = filepath.Join(p.dir, "sa.pub"), filepath.Join(p.dir, "sa.key")
	if err := writePEM(pubFile, "PUBLIC KEY", pub); err != nil {
		return "", "", err
	}
	return pubFile, keyFile, writeKey(keyFile, key)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "PRIVATE KEY", der)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// kubeconfig writes a kubeconfig for the user cn (in the groups orgs) of
// the apiserver at server, with its certificate embedded, and returns its
// path.
func (p *pki) kubeconfig(name, server, cn string, orgs ...string) (string, error) {
	certFile, keyFile, err := p.issue(name, cn, orgs)
	if err != nil {
		return "", err
	}
	var data [3][]byte
	for i, f := range []string{p.CAFile, certFile, keyFile} {
		if data[i], err = os.ReadFile(f); err != nil {
			return "", err
		}
	}
	b64 := base64.StdEncoding.EncodeToString
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: test
  context: {cluster: test, user: %s}
current-context: test
`, server, b64(data[0]), name, b64(data[1]), b64(data[2]), name)
	path := filepath.Join(p.dir, name+".kubeconfig")
	return path, os.WriteFile(path, []byte(cfg), 0o600)
}
