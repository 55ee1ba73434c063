{{/* Names: <release> when it already holds "weir", else <release>-weir; 63 is the DNS limit. */}}
{{- define "weir.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weir.weirNamespace" -}}
{{- default .Release.Name .Values.weirNamespace -}}
{{- end -}}

{{/* Labels `weir scale` and `weir status` select on: instance (release), component, pool. */}}
{{- define "weir.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "weir.labels" -}}
{{ include "weir.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Image of the weir container; a pool may override repository and tag. Args: (dict "root" $ "image" $override) */}}
{{- define "weir.image" -}}
{{- $image := mergeOverwrite (deepCopy .root.Values.image) (default dict .image) -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "weir.etcdUrl" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "http://%s-etcd.%s.svc:2379" (include "weir.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "etcd.endpoints is required when etcd.enabled is false" .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "weir.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats.%s.svc:4222" (include "weir.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "nats.url is required when nats.enabled is false" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{/* Pod-level fields shared by every pod the chart runs. */}}
{{- define "weir.podCommon" -}}
serviceAccountName: {{ include "weir.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "weir.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weir.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Addresses reach every weir pod from the one ConfigMap; its checksum rolls pods when it changes. */}}
{{- define "weir.configChecksum" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{- define "weir.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "weir.fullname" . }}-config
{{- end -}}

{{- define "weir.pdbApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1" -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end -}}

{{/* A pool's own labels; the argument is the merged pool entry. */}}
{{- define "weir.poolLabels" -}}
app.kubernetes.io/component: worker
weir.dev/pool: {{ .name }}
weir.dev/role: {{ .role }}
weir.dev/backend: {{ .backend }}
{{- end -}}

{{/* Non-empty when a pool has `role` (and, when given, serves `model`).
Args: (dict "root" $ "role" string ["model" string]) */}}
{{- define "weir.hasPool" -}}
{{- range .root.Values.pools -}}
{{- if and (eq .role $.role) (or (not $.model) (eq .model $.model)) }}true{{ end -}}
{{- end -}}
{{- end -}}

{{/* A pool's size: `replicas` at install; on upgrade, with keepScaledReplicas, the size running
now, so `helm upgrade` does not undo `weir scale` or an HPA. lookup finds nothing
under `helm template`, which therefore shows `replicas`. Args: (dict "root" $ "pool" $p "name" $name) */}}
{{- define "weir.poolReplicas" -}}
{{- $live := dict -}}
{{- if .pool.keepScaledReplicas -}}
{{- $live = lookup "apps/v1" "Deployment" .root.Release.Namespace .name | default dict -}}
{{- end -}}
{{- if and $live $live.spec -}}
{{- $live.spec.replicas -}}
{{- else -}}
{{- .pool.replicas -}}
{{- end -}}
{{- end -}}

{{- define "weir.clusterSecretEnv" -}}
{{- with .Values.clusterSecret }}
{{- if or .existingSecret .value }}
- name: WEIR_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-cluster-secret" (include "weir.fullname" $)) .existingSecret }}
      key: {{ .secretKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Request-plane TLS (requestPlaneTLS): the flags that read the Secret, its mount and its
volume, each as a list indented by `indent` (nothing when disabled). Servers (workers, router)
get tls.crt and tls.key; whoever dials (frontend, router) gets ca.crt, and a pod that only
dials is given ca.crt alone. Args: (dict "root" $ "serving" bool "dials" bool "indent" int) */}}
{{- define "weir.tlsDir" -}}
/etc/weir/request-plane-tls
{{- end -}}

{{- define "weir.tlsArgs" -}}
{{- if .root.Values.requestPlaneTLS.enabled -}}
{{- $dir := include "weir.tlsDir" . -}}
{{- $args := list -}}
{{- if .serving -}}
{{- $args = concat $args (list (printf "--tls-cert=%s/tls.crt" $dir) (printf "--tls-key=%s/tls.key" $dir)) -}}
{{- end -}}
{{- if .dials -}}
{{- $args = append $args (printf "--tls-ca=%s/ca.crt" $dir) -}}
{{- end -}}
{{- toYaml $args | nindent .indent -}}
{{- end -}}
{{- end -}}

{{- define "weir.tlsMount" -}}
{{- if .root.Values.requestPlaneTLS.enabled -}}
{{- printf "- {name: request-plane-tls, mountPath: %s, readOnly: true}" (include "weir.tlsDir" .) | nindent .indent -}}
{{- end -}}
{{- end -}}

{{- define "weir.tlsVolume" -}}
{{- with .root.Values.requestPlaneTLS -}}
{{- if .enabled -}}
{{- $secret := dict "secretName" (required "requestPlaneTLS.secretName is required when requestPlaneTLS.enabled is true" .secretName) -}}
{{- if not $.serving -}}
{{- $_ := set $secret "items" (list (dict "key" "ca.crt" "path" "ca.crt")) -}}
{{- end -}}
{{- toYaml (list (dict "name" "request-plane-tls" "secret" $secret)) | nindent $.indent -}}
{{- end -}}
{{- end -}}
{{- end -}}
